"""The contract between roles: identities and signatures, wire messages, config base, errors.

This package must never import torch, vLLM or a web server (a test enforces it), so that every
role's `--help` answers quickly and light tools (relays, chain clients) stay light.
"""
