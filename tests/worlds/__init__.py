"""Multi-process checks on real gloo ranks: one spawned world per test module (see _harness.run_world)."""
