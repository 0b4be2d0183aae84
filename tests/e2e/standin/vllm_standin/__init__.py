"""Test double for ``vllm serve`` used by the end-to-end rehearsal.

This is NOT vLLM. It is a small stand-in, installed as ``/usr/local/bin/vllm``
in the locally built rehearsal image (see ``tests/e2e/image/build.py``), that
behaves like ``vllm serve`` where the deployment can observe it:

* the command line: the same flag spellings as real vLLM (unknown flags exit 2
  with "unrecognized arguments"; ``--max-model-len`` accepts ``32k``/``32K``/
  ``auto`` exactly like vLLM's ``human_readable_int_or_auto``);
* the model argument: a path must be a directory holding ``config.json``;
* the Ray executor: with ``--distributed-executor-backend ray`` it joins the
  running Ray cluster (``ray.init(address="auto")``), checks ``VLLM_HOST_IP``
  against the alive Ray nodes, reserves ``[{"GPU": 1}] * (TP*PP)`` in a
  placement group and keeps one GPU actor per rank alive while serving;
* the engine's steps: every token (and every prefill chunk) waits for the engine core's next step, as vLLM's
  outputs come only from its engine core's steps: a SIGSTOPped engine core, a SIGSTOPped rank of a multi-node
  mp run (each step is a collective over every rank) or the "hang" fault stops every stream, /health still 200,
  the gauges as of the last step;
* the HTTP server: ``/health``, ``/version``, ``/metrics`` (vLLM's metric names:
  requests running, tokens, TTFT / inter-token / end-to-end histograms), ``/v1/models``
  and a deterministic ``/v1/chat/completions`` and ``/v1/completions`` (a prompt of
  text or token ids, ``ignore_eos``), streamed token by token at a set pace, with the
  ``--api-key``/``VLLM_API_KEY`` guard on ``/v1`` paths only; the port opens only
  after simulated weight loading, as the real server's does.

No model is loaded and no GPU is used. Environment variables read:
``VLLM_HOST_IP``, ``VLLM_API_KEY``, ``VLLM_PLACEMENT_TIMEOUT_S`` (default 60),
``STANDIN_LOAD_SECONDS`` (default 2), ``STANDIN_COMPILE_SECONDS`` (default 1: a graph not in the
torch.compile cache; one there loads in 0.1 s), ``STANDIN_LOCAL_GPUS`` (default 1),
``STANDIN_PING_TIMEOUT_S`` (default 5), ``STANDIN_DEAD_LINGER_S`` (default 2),
``STANDIN_TOKENS_PER_SECOND`` (default 100, each request's decode rate),
``STANDIN_PREFILL_TOKENS_PER_SECOND`` (default 10000), ``STANDIN_PREFILL_CHUNK_TOKENS`` (default 8192: a prompt
is prefilled in chunks this size, one engine step each), ``STANDIN_FAULT_FILE`` (default
/tmp/vllm-standin-fault: "hang" stops the engine's steps, "wrong" answers other tokens; read while it runs),
``RAY_ADDRESS`` (through Ray).

Everything except ``engine.py`` is pure standard library; ``ray`` is imported
lazily so that the unit tests run without it.
"""

from .versions import played

# the vLLM release the stand-in plays (versions.py): what `vllm --version`, /version and the image probe say
__version__ = played()
