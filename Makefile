# The README's two commands: `make train` and `make test`. Both set up first (idempotent).
.PHONY: setup train test bench

setup:
	bash scripts/setup.sh

train: setup
	.venv/bin/embodied train configs/maniskill/pushcube_ppo.yaml

# two pytest workers, a test file each at a time (its module fixtures built once); the 15 slowest
# tests printed at the end, to see where the budget goes
test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -n 2 --dist loadfile --durations=15

bench: setup
	.venv/bin/python benchmarks/rollout_overhead.py
