"""What the gateway adds on top of the engine: latency, time to first token, throughput, CPU per call.

Three processes: the upstream (the fixed-output `fixed_upstream`, or real vLLM with `--upstream vllm`),
the gateway (`tracetrain serve --engine vllm --engine-url …` on a fresh SQLite store) and the load
generator. For each concurrency, non-streamed and streamed, the same conversations go direct to the
upstream's `/v1/chat/completions` and through the gateway's `/s/<session>/…` in each of its APIs, in
rounds whose target order rotates so that background load hits every target alike. Afterwards every
completion id the gateway answered with is looked up in its store.

    python -m bench.gateway_overhead                   # fixed upstream, concurrency 1, 16, 64
    python -m bench.gateway_overhead --upstream vllm   # real vLLM, small counts
    python -m bench.gateway_overhead --parts redaction # redaction's CPU per call and the detectors only

Two parts (`--parts overhead,redaction`, both by default), one results file: `overhead` is the run above;
`redaction` times the serving core's redaction steps in this process, no servers (module `redaction`).

One job per module, in the order a run uses them:

- `cli`: the flags and the run from start to end;
- `servers`: the upstreams (fixed, vLLM, one already running) and the gateway processes;
- `fixed_upstream`, `fixed_answer`: the no-op upstream server (`python -m bench.gateway_overhead.fixed_upstream`)
  and its one answer, serialized once;
- `workload`: what the clients send (words, conversations, sessions);
- `apis`, `client`: request bodies per API, and the lean HTTP/1.1 client that sends them;
- `load`: the load generator (targets, phases, rounds) and its per-target statistics;
- `cpu`: CPU seconds of process groups and threads, read from /proc;
- `store_check`: received completion ids against the store's `calls`;
- `report`: the result tables and notes;
- `redaction`: the part `redaction`.
"""
