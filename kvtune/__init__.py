"""kvtune: offline compression-policy profiler and autotuner for KV caches.

kvtune answers "which KV-cache compression policy should this deployment use at link bandwidth
B, under accuracy floor q?" for a model and workload, by evaluating Transform -> Quantize ->
Codec policies on real KV caches and compiling the Pareto front into a policy table.
"""

__version__ = "0.1.0"
