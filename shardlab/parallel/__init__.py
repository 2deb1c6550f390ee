"""The runtime side of a layout: joining the world (`world`), torch's DeviceMesh (`device_mesh`), and `apply`, the one
door to torch's parallel APIs, with what it installs: pipeline stages (`stages`), context-parallel attention
(`context`), expert dispatch (`experts`), activation checkpointing and compile."""
