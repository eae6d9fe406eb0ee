"""Research tooling: sweep guards and run comparison.

tools.guards   refuse Hydra multirun + subprocess DDP (a Hydra callback and a function for train.py)
tools.runs     read local run directories (config.yaml, metrics.csv, eval/**/results.json)
tools.compare  CLI: python -m tools.compare <multirun dir or run dirs...> -> markdown table + PNG plots
tools.runlog   what a run says: plain lines and warnings on stderr and in its train.log
"""
