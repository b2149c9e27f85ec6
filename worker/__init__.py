"""Model execution: catalog, adapters, batching, pre/post-processing; front doors serve (HTTP) and ipc."""

from pathlib import Path

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"
DEFAULT_MODELS_DIR = CATALOG_DIR / "models"
DEFAULT_BUNDLES_DIR = CATALOG_DIR / "bundles"

# Model processes on a GPU device by default (SIE_MODEL_PROCESSES): ``sie serve``'s processes and a worker
# pod's (the chart's workers.gpuModelProcesses, ``sie up --model-processes``). One Python process cannot
# keep an H100 busy with small encoders: its one GIL tokenises, launches kernels and answers (measured:
# 512-token texts, bge-base shape, 1 process 57% GPU busy, 4 processes 90-95%).
CUDA_PROCESSES = 4

# GOMP_SPINCOUNT of the worker process in a pod (``sie up``, the chart, compose; an operator's own value
# wins). When a forward ends, libgomp's OpenMP threads spin, by default about 300,000 iterations,
# before they sleep: they hold a core just when the sidecar answers the batch and hands over the next
# (and, under ``sie up``, the gateway and NATS pass the answers on). 10,000 still spins through the
# short waits inside a forward. ``sie serve`` keeps libgomp's default (one run on 2 cores: the same
# 1 x 16 rate with less CPU at 10,000, but one client's single-item requests about 10% slower).
POD_OMP_SPINCOUNT = "10000"

# OMP_PROC_BIND of the worker process that ``sie up`` starts when it runs one worker pod, with one forward
# thread of several intra-op threads, on a host without a GPU (an operator's own value wins). libgomp then
# binds the process's first thread to the first core, and every thread the worker starts afterwards
# inherits that core: the event loop, IPC, tokenising and postprocessing threads, and the forward's first
# intra-op thread; the forward's other intra-op threads are bound one to each further core. The worker's
# own helpers then never take two cores from a running forward at once, and the scheduler never stacks two
# intra-op threads on one core. Measured on 2 cores (MiniLM, 1 x 16, two clusters side by side with sie
# serve): 0.936x sie serve against 0.860x, and 0.905x against 0.856x; a variant that bound only the
# intra-op threads and left the helpers free did worse (0.785x). Not for several workers on one host,
# several forward threads in one worker or a single intra-op thread (all would bind to the same first core), nor for
# CUDA (the tokenising threads must spread over the cores), nor for pods that share a node without an
# exclusive cpuset (the chart and compose leave it unset for that reason).
POD_OMP_PROC_BIND = "true"
