"""`pdserve bench`: a load generator and report for any pdserve router (docs/benchmarks.md, "pdserve bench").

`workload` (length laws, arrivals, traces, fresh prompts), `runner` (asyncio streams in worker processes, timings),
`report` (TTFT / TPOT / ITL / E2E percentiles, throughput, errors, goodput, sweeps), `plots` (matplotlib PNGs),
`cli` (the command).
"""
