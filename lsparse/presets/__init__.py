"""Compile presets: TOML files of CompileOptions fields, read by `lsparse compile --config NAME`."""
