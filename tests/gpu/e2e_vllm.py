"""GPU end-to-end check of kvwire in vLLM (driven by tests/gpu/e2e_vllm.sh; read its header).

1. A tiny Llama (config.json + a word-level tokenizer written here, random weights through
   ``--load-format dummy``: nothing is downloaded) served by ONE vLLM instance without a KV
   connector: greedy completions of a few prompts = the reference.
2. The same model as a P instance and a D instance on the same GPU, each with the connector
   under test; every prompt goes to P (``max_tokens: 1``, prefill) and to D (decode) with one
   ``transfer_id`` (our minimal proxy: direct requests, in parallel, from this script). With the
   kvwire connector the KV caches are on the GPU, so both workers stage through pinned host
   memory (``staging`` auto, kvwire.vllm.staging): P gathers each layer into its pool and writes
   from there, D lands into a host mirror and copies to the GPU before reporting the request.
3. D's token ids must equal the reference for every prompt, D's ``/metrics`` must count the
   prompt tokens as ``external_kv_transfer`` (D did not prefill them itself: at most one token
   per request computed locally, the one vLLM always recomputes), and P must have computed them.

Exit status 0 only when all of this ran and held; anything else is a failure (the shell script
handles the no-GPU case before calling this)."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

VOCAB = 1000
HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 4, 4, 2


def log(msg):
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_model(d):
    """config.json of a tiny Llama plus a word-level tokenizer ("w0".."w996")."""
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(VOCAB - 3)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)
    return d


def prompts(n, seed=7):
    """Deterministic prompts of different lengths (several blocks each)."""
    out = []
    x = seed
    for i in range(n):
        words = []
        for _ in range(40 + 37 * i):
            x = (x * 1103515245 + 12345) % (1 << 31)
            words.append(f"w{x % (VOCAB - 3)}")
        out.append(" ".join(words))
    return out


def http(method, url, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return raw.decode()


class Server:
    """One ``vllm serve`` process, its log in OUT/<name>.log."""

    def __init__(self, name, args, out, env, port, model):
        self.name, self.port = name, port
        self.logf = open(os.path.join(out, f"{name}.log"), "w")
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port),
               "--host", "127.0.0.1", *args]
        log(f"start {name}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.logf.name}")
            try:
                http("GET", f"http://127.0.0.1:{self.port}/health", timeout=5)
                log(f"{self.name} ready after {time.monotonic() - t0:.0f} s")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)
        raise RuntimeError(f"{self.name} not ready within {timeout} s; see {self.logf.name}")

    def complete(self, prompt, max_tokens, params=None):
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        r = json.loads(http("POST", f"http://127.0.0.1:{self.port}/v1/completions", body))
        c = r["choices"][0]
        return {"text": c.get("text"), "token_ids": c.get("token_ids"), "kv_transfer_params": r.get("kv_transfer_params")}

    def metrics(self):
        return http("GET", f"http://127.0.0.1:{self.port}/metrics", timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.logf.close()


def prompt_tokens_by_source(text):
    """{source: total} from vllm:prompt_tokens_by_source_total lines of /metrics."""
    out = {}
    for m in re.finditer(r'^vllm:prompt_tokens_by_source_total\{([^}]*)\}\s+([0-9.eE+]+)', text, re.M):
        src = re.search(r'source="([^"]+)"', m.group(1))
        if src:
            out[src.group(1)] = out.get(src.group(1), 0.0) + float(m.group(2))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", choices=["kvwire", "mooncake"], default="kvwire")
    ap.add_argument("--roles", choices=["pd", "both"], default="pd",
                    help="pd: kv_producer + kv_consumer; both: kv_both on each side")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mem", default="0.3", help="--gpu-memory-utilization of each instance")
    ap.add_argument("--ready-timeout", type=int, default=900)
    ap.add_argument("--shim-dir", default="")
    ap.add_argument("--staging", choices=["auto", "always", "never", "device"], default="auto",
                    help="kvwire's staging option on P and D (auto: CUDA KV caches go through pinned host memory; "
                         "device: registered where they are, moved by cuda_ipc)")
    ap.add_argument("--staging-mb", default="256", help="kvwire's staging_mb on P and D (P's pool size)")
    ap.add_argument("--kv-blocks", type=int, default=2048,
                    help="--num-gpu-blocks-override of every instance (D's staging mirrors the whole KV cache in "
                         "pinned host memory: keep it small)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = make_model(os.path.join(a.out, "model"))
    name = "kvwire-tiny"
    common = ["--served-model-name", name, "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0",
              "--max-model-len", "2048", "--max-num-seqs", "16", "--block-size", "16", "--enforce-eager",
              "--gpu-memory-utilization", a.mem, "--no-enable-prefix-caching",
              "--num-gpu-blocks-override", str(a.kv_blocks)]
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    texts = prompts(a.prompts)
    servers = []
    try:
        # 1. Reference: one instance, no connector.
        ref = Server("single", common, a.out, env, 8300, model)
        servers.append(ref)
        ref.model_name = name
        ref.wait_ready(a.ready_timeout)
        want = [ref.complete(t, a.max_tokens) for t in texts]
        for w in want:
            assert w["token_ids"] and len(w["token_ids"]) == a.max_tokens, w
        log(f"reference: {[w['token_ids'][:6] for w in want]}")
        ref.stop()
        servers.remove(ref)

        # 2. P and D with the connector under test.
        p_role, d_role = ("kv_both", "kv_both") if a.roles == "both" else ("kv_producer", "kv_consumer")
        if a.connector == "kvwire":
            p_cfg = {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.vllm",
                     "kv_role": p_role, "kv_connector_extra_config": {
                         "control_listen": "127.0.0.1:7100", "data_listen": "127.0.0.1:7200",
                         "send_mode": "layerwise", "secret": "e2e",
                         "staging": a.staging, "staging_mb": float(a.staging_mb)}}
            d_cfg = {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.vllm",
                     "kv_role": d_role, "kv_connector_extra_config": {
                         "control_listen": "127.0.0.1:7101", "data_listen": "127.0.0.1:7201",
                         "policy": "lazy", "secret": "e2e",
                         "staging": a.staging, "staging_mb": float(a.staging_mb)}}
            p_env, d_env = env, env

            def params(tid):
                return ({"do_remote_decode": True, "transfer_id": tid, "remote_control": "127.0.0.1:7101"},
                        {"do_remote_prefill": True, "transfer_id": tid, "remote_control": "127.0.0.1:7100"})
        else:  # vLLM's own MooncakeConnector with mooncake.engine = kvwire.mooncake (shim)
            shim = a.shim_dir
            p_cfg = {"kv_connector": "MooncakeConnector", "kv_role": p_role, "engine_id": "e2e-p",
                     "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
            d_cfg = {"kv_connector": "MooncakeConnector", "kv_role": d_role, "engine_id": "e2e-d",
                     "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
            pp = shim + os.pathsep + env.get("PYTHONPATH", "")
            p_env = dict(env, PYTHONPATH=pp, VLLM_MOONCAKE_BOOTSTRAP_PORT="8998")
            d_env = dict(env, PYTHONPATH=pp, VLLM_MOONCAKE_BOOTSTRAP_PORT="8999")

            def params(tid):
                return ({"do_remote_decode": True, "transfer_id": tid},
                        {"do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "e2e-p",
                         "remote_bootstrap_addr": "http://127.0.0.1:8998"})

        p = Server("prefill", common + ["--kv-transfer-config", json.dumps(p_cfg)], a.out, p_env, 8100, model)
        servers.append(p)
        d = Server("decode", common + ["--kv-transfer-config", json.dumps(d_cfg)], a.out, d_env, 8200, model)
        servers.append(d)
        for s in (p, d):
            s.model_name = name
            s.wait_ready(a.ready_timeout)

        got = []
        for i, t in enumerate(texts):
            tid = f"e2e-{i}-{uuid.uuid4().hex[:8]}"
            pp_, dp_ = params(tid)
            res = {}

            def run_d():
                try:
                    res["d"] = d.complete(t, a.max_tokens, dp_)
                except Exception as e:  # reported below
                    res["d_err"] = e

            th = threading.Thread(target=run_d)
            th.start()  # D first: with the lazy policy it holds nothing until P started
            res["p"] = p.complete(t, 1, pp_)
            th.join(600)
            if th.is_alive() or "d_err" in res:
                raise RuntimeError(f"D failed on prompt {i}: {res.get('d_err', 'no answer in 600 s')}")
            got.append(res["d"])
            log(f"prompt {i}: P {res['p']['token_ids']} D {res['d']['token_ids'][:6]}...")

        ok = True
        for i, (w, g) in enumerate(zip(want, got)):
            if w["token_ids"] != g["token_ids"]:
                ok = False
                log(f"FAIL prompt {i}: D {g['token_ids']} != single instance {w['token_ids']}")
        n_prompt = sum(len(t.split()) for t in texts)  # word-level tokenizer: one token a word
        dm, pm = prompt_tokens_by_source(d.metrics()), prompt_tokens_by_source(p.metrics())
        log(f"D prompt tokens by source: {dm}; P: {pm}; prompt words: {n_prompt}")
        if not dm:
            ok = False
            log("FAIL: D's /metrics has no vllm:prompt_tokens_by_source_total")
        else:
            if dm.get("local_compute", 0) > len(texts):
                ok = False
                log(f"FAIL: D computed {dm.get('local_compute')} prompt tokens itself (at most {len(texts)} allowed)")
            if dm.get("external_kv_transfer", 0) < n_prompt - len(texts):
                ok = False
                log(f"FAIL: D received {dm.get('external_kv_transfer', 0)} prompt tokens over the connector, "
                    f"expected >= {n_prompt - len(texts)}")
        if pm and pm.get("local_compute", 0) < n_prompt - len(texts):
            ok = False
            log(f"FAIL: P computed only {pm.get('local_compute')} prompt tokens")
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"ok": ok, "connector": a.connector, "roles": a.roles, "want": want, "got": got,
                       "d_sources": dm, "p_sources": pm}, f, indent=1)
        log("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
