"""Every native source of kimiserve, in one place at the top of the repository: the weight-streaming engine's C++
(`stream_engine.cpp`) and its builder (`build.py`, `python -m native.build`).

It is a package so that every install of kimiserve (a wheel, the Docker image) carries the source as package data and
builds the same engine as a checkout; `shard_svc/weight_streaming/native.py` builds and loads the engine from here on
first use.
"""
