"""The native weight-streaming engine's C++ source (`stream_engine.cpp`) and its builder (`build.py`).

They live inside the package, as package data, so every install of kimiserve (a wheel, the Docker image) carries
them; `shard_svc/streaming/native.py` builds and loads the engine from here on first use.
"""
