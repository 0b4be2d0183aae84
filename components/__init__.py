"""spark-vllm: Pulumi components that deploy vLLM over Ray across Docker hosts reached by SSH."""
