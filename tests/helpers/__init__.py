"""What the tests share: agents (agents.py), SSE streams (sse.py), replicas and live moves
(migration.py), a fault kit and a TCP proxy for faults on the wire (faults.py, proxy.py), sample
checkpoints (checkpoints.py), an OTLP collector (otlp_sink.py) and the vLLM tests' model (vllm_model.py)."""
