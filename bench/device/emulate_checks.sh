#!/usr/bin/env bash
# The checks of `emulate_device_env.sh check` (run inside the emulated env: python3, PYTHONPATH and PATH as the
# install scripts set them). Also runnable as is on the device after install_ray.sh, install_mlflow.sh and
# install_vllm.sh. Every process it starts it ends by PID (processes whose command line names its private temp
# dir, or the process group it started), never by name; each check prints PASS or FAIL with its output's last
# lines. Ports: RAY_PORT (6390), DASH_PORT (8265), MLFLOW_PORT (5000).
set -u
X=$(mktemp -d /tmp/peagle-emu.XXXXXX)   # short: Ray's socket paths live under its temp dir
export RAY_TMPDIR=$X/local; mkdir -p "$RAY_TMPDIR"  # local ray.init() (build_processor, ...) too, not /tmp/ray
FAILED=0
check() {  # check NAME CMD...: run CMD, print PASS NAME and its "=> " lines, or FAIL NAME and its last lines
  local name=$1 out; shift
  if out=$("$@" 2>&1); then
    echo "PASS $name"
    if [ "${out#*=> }" != "$out" ]; then printf '%s\n' "$out" | grep "^=> " | sed 's/^/    /'; return; fi
  else
    echo "FAIL $name"; FAILED=$((FAILED + 1))
  fi
  printf '%s\n' "$out" | grep -v -E "^\s*$" | tail -n "${TAIL:-12}" | sed 's/^/    /'
}
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
port_or_free() {  # PORT, or a free one where something else listens on it (the CPU box is shared)
  if python3 -c "import socket, sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $1)) != 0)"; then
    local p; p=$(free_port); echo "port $1 is taken here: $p instead" >&2; echo "$p"
  else echo "$1"; fi
}
ray_start() {  # `ray start ARGS`, its summary lines as "=> " lines (its whole log when it fails)
  ray start "$@" > "$X/ray_start.log" 2>&1; local rc=$?
  sed -E 's/\x1b\[[0-9;]*m//g' "$X/ray_start.log" | grep -E "Ray runtime started|Local node IP" | sed 's/^/=> /'
  [ $rc = 0 ] || cat "$X/ray_start.log"
  return $rc
}
kill_tree() {  # the processes whose command line names $X, and their children
  python3 - "$X" <<'EOF'
import signal, sys, psutil
key, me = sys.argv[1], psutil.Process()
spare = {me.pid} | {p.pid for p in me.parents()}
found = {}
for p in psutil.process_iter(["cmdline"]):
    try:
        if any(key in part for part in p.info["cmdline"] or []) and p.pid not in spare:
            found[p.pid] = p
            for c in p.children(recursive=True):
                if c.pid not in spare:
                    found.setdefault(c.pid, c)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
procs = list(found.values())
for p in procs:
    try:
        p.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass
_, alive = psutil.wait_procs(procs, timeout=10)
for p in alive:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass
print(f"ended {len(procs)} processes")
EOF
}

# 1. imports: Ray Serve, Serve LLM, Data LLM, Ray metrics; vLLM's Ray metrics wrappers find them
check imports python3 -c "
from ray import serve; import ray.serve.llm; import ray.data.llm; from ray.util import metrics
import vllm, ray
from vllm.v1.metrics import ray_wrappers
assert ray_wrappers.ray_metrics is not None, 'vllm.v1.metrics.ray_wrappers: ray.util.metrics not found'
print('=>', 'ray', ray.__version__, 'vllm', vllm.__version__, 'serve', serve.__name__, 'ray_wrappers ok')"

# 2. constructions: a ray.data.llm vLLM processor (no GPU touched), a GPU LLMConfig
python3 -c "
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)).save_pretrained('$X/tiny')" \
  >/dev/null 2>&1
check build_processor python3 -c "
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
from ray.data.llm import build_processor, vLLMEngineProcessorConfig
cfg = vLLMEngineProcessorConfig(model_source='$X/tiny', engine_kwargs={'dtype': 'bfloat16', 'max_model_len': 128},
    concurrency=1, batch_size=4, chat_template_stage=True, tokenize_stage=False, detokenize_stage=False)
p = build_processor(cfg, preprocess=lambda r: {'messages': r['m'], 'sampling_params': {'max_tokens': 4}},
                    postprocess=lambda r: r)
print('=>', type(p).__name__, [type(s).__name__ for s in getattr(p, 'stages', {}).values()] if isinstance(getattr(p, 'stages', None), dict) else '')"
check llm_config python3 -c "
from ray.serve.llm import LLMConfig, build_llm_deployment
c = LLMConfig(model_loading_config={'model_id': 'tiny', 'model_source': '$X/tiny'},
              engine_kwargs={'dtype': 'bfloat16'}, accelerator_config={'kind': 'gpu'},
              deployment_config={'autoscaling_config': {'min_replicas': 1, 'max_replicas': 1}})
app = build_llm_deployment(c)
print('=>', 'LLMConfig', c.model_id, type(c.accelerator_config).__name__, '-> build_llm_deployment:', type(app).__name__)"

check replica_modules python3 -c "
import importlib
# what a Serve LLM replica and ray.data.llm's engine stage import only when they start (not import ray.serve.llm)
for m in ('ray.llm._internal.serve.engines.vllm.vllm_engine', 'ray.llm._internal.serve.core.server.llm_server',
          'ray.llm._internal.batch.stages.vllm_engine_stage'):
    importlib.import_module(m)
print('=>', 'replica and engine-stage modules import')"
check peagle_serve_app python3 -c "
from ray.serve.llm import build_llm_deployment
from pipelines.serve import Backend, ServeAppArgs, build_ingress, build_llm_config
from pipelines.serve import gateway  # the gateway ingress: a subclass of Ray's OpenAiIngress
args = ServeAppArgs(head=None, accelerator='gpu', max_replicas=4, upscale_delay_s=5, engine_kwargs={'max_model_len': 128})
c = build_llm_config(args, target_path='$X/tiny', target_config=None, head=None)
app = build_ingress(Backend(args=args, llm_config=c, head_ref=None, served={}, label='nohead', digest='0' * 64),
                    server=build_llm_deployment(c))
print('=>', 'peagle app', type(app).__name__, c.deployment_config['autoscaling_config'])"

# 3. a head with the dashboard and the Jobs API (token auth, as pipelines/local_ray.py), a second raylet, a job
python3 -c "import secrets; print(secrets.token_hex(32))" > "$X/auth_token" && chmod 600 "$X/auth_token"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$X/auth_token RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS
RAY_PORT=$(port_or_free "${RAY_PORT:-6390}") DASH_PORT=$(port_or_free "${DASH_PORT:-8265}")
F0=$FAILED
check ray_head ray_start --head --temp-dir="$X/ray" --port="$RAY_PORT" --node-ip-address=127.0.0.1 \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" --include-dashboard=true --num-cpus 4 \
  --disable-usage-stats --ray-client-server-port="$(free_port)" --dashboard-agent-listen-port="$(free_port)" \
  --dashboard-agent-grpc-port="$(free_port)" --metrics-export-port="$(free_port)" \
  --runtime-env-agent-port="$(free_port)"
FAILED_HEAD=$((FAILED - F0))
if [ "$FAILED_HEAD" = 0 ]; then  # no head of ours: the ports may be another cluster's (the CPU box is shared)
check dashboard python3 -c "
import time, urllib.request, urllib.error
url = 'http://127.0.0.1:$DASH_PORT/api/version'
token = open('$X/auth_token').read().strip()
for _ in range(60):
    try:
        urllib.request.urlopen(url, timeout=2)
        raise SystemExit('answered without the token: token auth is off')
    except urllib.error.HTTPError as e:
        if e.code != 401: raise
        print('=>', 'without the token:', e.code, e.reason); break
    except urllib.error.URLError as e:
        err = e; time.sleep(1)
else:
    raise SystemExit(f'dashboard not up: {err}')
req = urllib.request.Request(url, headers={'Authorization': f'Bearer {token}'})
print('=>', 'with the token:', urllib.request.urlopen(req, timeout=5).read().decode()[:160])"
check second_raylet ray_start --address "127.0.0.1:$RAY_PORT" --node-ip-address=127.0.0.1 --num-cpus 2 \
  --resources '{"node2": 1}' --temp-dir="$X/ray" --disable-usage-stats \
  --dashboard-agent-listen-port="$(free_port)" --dashboard-agent-grpc-port="$(free_port)" \
  --metrics-export-port="$(free_port)" --runtime-env-agent-port="$(free_port)"
check two_nodes python3 -c "
import time, ray
ray.init(address='127.0.0.1:$RAY_PORT', log_to_driver=False)
for _ in range(30):
    alive = [n for n in ray.nodes() if n['Alive']]
    if len(alive) == 2: break
    time.sleep(1)
print('=>', 'alive nodes:', len(alive), sorted(k for n in alive for k in n['Resources'] if k == 'node2'))
assert len(alive) == 2
@ray.remote(resources={'node2': 1})
def where(): return ray.get_runtime_context().get_node_id()
print('=>', 'task on node2:', ray.get(where.remote())[:12])"
check job_submit bash -c "ray job submit --address http://127.0.0.1:$DASH_PORT -- python -c 'print(1)' 2>&1 | sed -E 's/\\x1b\\[[0-9;]*m//g' | grep -E '^1$|succeeded|failed' | sed 's/^/=> /'; exit \${PIPESTATUS[0]}"
SERVE_PORT=$(free_port)
check serve_app python3 -c "
import ray, requests
from ray import serve
ray.init(address='127.0.0.1:$RAY_PORT', log_to_driver=False)
@serve.deployment(ray_actor_options={'num_cpus': 0.1})
class Hello:
    def __call__(self, request): return 'hello'
serve.start(http_options={'host': '127.0.0.1', 'port': $SERVE_PORT})
h = serve.run(Hello.bind(), name='emu', route_prefix='/emu')
print('=>', 'handle:', h.remote(None).result(), 'http:', requests.get('http://127.0.0.1:$SERVE_PORT/emu', timeout=30).text)
serve.shutdown()"
else
  echo "SKIP dashboard, second_raylet, two_nodes, job_submit, serve_app (no head)"
fi
kill_tree | sed 's/^/    ray: /'

# 4. an MLflow server (SQLite store, local artifacts) and the client against it
mkdir -p "$X/mlflow/artifacts"
MLFLOW_PORT=$(port_or_free "${MLFLOW_PORT:-5000}")
setsid mlflow server --backend-store-uri "sqlite:///$X/mlflow/mlflow.db" --default-artifact-root "$X/mlflow/artifacts" \
  --host 127.0.0.1 --port "$MLFLOW_PORT" > "$X/mlflow/server.log" 2>&1 &
MLFLOW_PID=$!
check mlflow_health bash -c "for i in \$(seq 300); do curl -sf -m 5 -o $X/health http://127.0.0.1:$MLFLOW_PORT/health && echo \"=> /health: \$(cat $X/health) after \$SECONDS s\" && exit 0; sleep 1; done; tail -20 $X/mlflow/server.log; exit 1"
check mlflow_client python3 -c "
import mlflow
c = mlflow.MlflowClient('http://127.0.0.1:$MLFLOW_PORT')
print('=>', 'registered models before:', len(c.search_registered_models()))
c.create_registered_model('emu-head')
mlflow.set_tracking_uri('http://127.0.0.1:$MLFLOW_PORT')
with mlflow.start_run() as run:
    mlflow.log_metric('x', 1.0); mlflow.log_text('hi', 'a.txt')
v = c.create_model_version('emu-head', f'runs:/{run.info.run_id}/a.txt', run_id=run.info.run_id)
print('=>', 'mlflow', mlflow.__version__, 'models:', [m.name for m in c.search_registered_models()], 'version', v.version)"
kill -- -"$MLFLOW_PID" 2>/dev/null; wait "$MLFLOW_PID" 2>/dev/null
kill_tree | sed 's/^/    mlflow: /'

rm -rf "$X"
echo "$FAILED failed"
exit "$FAILED"
