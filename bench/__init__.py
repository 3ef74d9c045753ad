"""Benchmark programs: each is run as `python -m bench.<name>` from the repository root (bench/README.md lists
them and their latest results). `bench.harness` is what they share; `bench.loopback` and `bench.adversaries`
are the network on 127.0.0.1 and the cheating peers that the attack bench and the tests both use."""
