"""`relayout bench vllm`: live migration and protection between stock vLLM replicas."""
