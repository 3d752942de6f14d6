"""Semantic Cache Distillation (SCD): cross-model KV transfer from a producer to a consumer."""
