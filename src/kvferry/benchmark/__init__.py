"""The benchmark suite behind ``kvferry bench``: planning, bandwidth and control-plane latency against
baselines measured in the same run. Above ``workload``; below ``cli``; imported only when a benchmark runs.
"""
