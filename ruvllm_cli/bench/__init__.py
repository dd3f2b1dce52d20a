"""`ruvllm benchmark`: a runner that drives the engine, metrics as pure functions over
its token timestamps, system and memory facts, formatters and the --compare gate."""
