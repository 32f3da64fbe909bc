"""Generated gRPC stubs of `proto/sitsd/api/v1/*.proto` (run `python proto/generate.py`)."""
