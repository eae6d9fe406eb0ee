"""Research analysis: receptive-field coverage and small-world metrics of attention graphs, probe evaluation.

analysis.attention_graph  band paths of each layer, drawn through model.permutation and kernels.default_band
analysis.reachability     packed-bitset reachability through stacked layers (coverage)
analysis.theory           exact SWA and mean-field SA / gated coverage curves
analysis.smallworld       clustering and path length, Watts-Strogatz / random references
analysis.coverage         CLI: python -m analysis.coverage --n 32768 --w 256 --layers 8 --out <dir>
analysis.probe_eval       CLI: python -m analysis.probe_eval ckpt=<run dir or .ckpt>
"""
