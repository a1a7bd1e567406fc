"""llama.cpp (llama-cpp-python) decoding a GGUF model, for bench/decode_q8.sh: tokens/s
of one stream (Llama.eval of one token at a time) and of S streams (one llama_decode a
step of a batch holding one new token for each of S sequences), the median of ROUNDS
rounds of STEPS steps after 2 warm-up steps. Prints one JSON line.
    python bench/decode_q8_llamacpp.py MODEL.gguf [THREADS] [STEPS] [ROUNDS] [S]"""
import ctypes, json, statistics, sys, time
import llama_cpp

path = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
S = int(sys.argv[5]) if len(sys.argv) > 5 else 16

llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=64 * S, n_batch=64,
                      n_seq_max=S, verbose=len(sys.argv) > 6)
vocab = llm.n_vocab()


def one_stream():
    llm.reset()
    llm.eval([1, 2, 3, 4])
    ts = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        llm.eval([(7 * i + 5) % vocab])
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    return 1 / statistics.median(ts)


def many_streams():
    # a context of its own holding S sequences (Llama's holds one)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 64 * S, 64, 64, S
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm.model, cp)
    batch = llama_cpp.llama_batch_init(S, 0, S)
    ts = []
    for i in range(steps + 2):
        batch.n_tokens = S
        for s in range(S):
            batch.token[s] = (7 * i + s) % vocab
            batch.pos[s] = i
            batch.n_seq_id[s] = 1
            batch.seq_id[s][0] = s
            batch.logits[s] = 1
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode: {rc}")
        llama_cpp.llama_get_logits(ctx)  # the logits are ready (decode may run asynchronously)
        llama_cpp.llama_synchronize(ctx)
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return S / statistics.median(ts)


one = [one_stream() for _ in range(rounds)]
many = [many_streams() for _ in range(rounds)]
print(json.dumps({"bench": "decode_q8_llamacpp", "model": path, "threads": threads, "llama_cpp": llama_cpp.__version__,
                  "s1_tok_s": round(statistics.median(one), 2), f"s{S}_tok_s": round(statistics.median(many), 2),
                  "s1_rounds": [round(x, 2) for x in one], f"s{S}_rounds": [round(x, 2) for x in many]}))
