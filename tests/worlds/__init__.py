"""Multi-process checks on real gloo ranks: a world per test module or shared by several (see _harness.run_world)."""
