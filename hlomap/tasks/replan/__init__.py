"""Re-planning a pipeline while its resources change (AutoPipe).

`trace` (resource traces: JSON format, generators), `options` (keep / two-worker move / re-solve,
step times and migration costs), `policies` (static, re-solve, the switch arbiter, meta, oracle;
playing them over a trace), `meta` (the LSTM gain predictor), `replay_plan` (a saved plan against a
trace). Every pipeline cost-model and DP call goes through `tasks.placement.pipeline_costs`.
"""
