"""What describes the target card: its profile (device_profile.py: capacity, dtypes, kernels, workspaces, context;
conf/device/) and the allocator's settings (alloc_conf.py: measure.alloc_conf, read by torch's rules)."""
