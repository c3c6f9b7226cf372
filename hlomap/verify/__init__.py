"""XLA and the unsharded step as oracles for what hlomap derives.

- `compile`: the one place a step is compiled under a plan (mesh, in/out shardings, donation,
  optionally XLA's shardy dump);
- `xla`: collectives, FLOPs and memory read from the compiled module, against a `StepEstimate`;
- `shardings`: the shardings XLA's propagation chose, against the factor graph's;
- `numerics`: the step under a plan against the unsharded step (`compare_outputs`, `run_plan`);
- `devices`: microbenchmarks of the present devices, the samples `hlomap calibrate` fits;
- `timing`: competing steps timed in interleaved rounds (medians and spread).
- `fidelity`: predicted against measured step times of a set of plans (ranks, Spearman, the
  picks' slowdowns), for `scripts/bench_fidelity.py`.
"""
