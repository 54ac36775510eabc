# The README's two commands: `make train` and `make test`. Both set up first (idempotent).
.PHONY: setup train test bench

setup:
	bash scripts/setup.sh

train: setup
	.venv/bin/embodied train configs/maniskill/pushcube_ppo.yaml

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest

bench: setup
	.venv/bin/python benchmarks/rollout_overhead.py
