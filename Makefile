# The two commands of the README: `make run` (set up, then the main job) and `make test`.
VENV := .venv/bin

.PHONY: setup run test test-fast lint ruff typecheck docs docs-serve bench convergence stragglers chaos mutation wan wan-digits wan-lr wan-link wan-stripes \
	imports fuzz clean soak

setup:
	@bash scripts/setup.sh

## the main job: decentralized training on the digits dataset with 4 local workers
run: setup
	$(VENV)/decentrun -np 4 --topology exponential -- $(VENV)/python examples/train_digits.py

## the whole test suite against real daemons, after ruff: first every test that may share the
## machine, on 2 pytest-xdist workers (a file's tests on one worker, which keeps its daemons for
## them), then those marked serial (namespaces, whole deployments), two at a time (pytest 9
## ignores pytest-xdist's groups: each test is its own), with mypy beside them (that tier
## leaves most of the CPU idle: it waits on timers and links). Two malloc
## arenas per process, not eight per core: the test processes and the daemons they start run
## many threads (gRPC, executors), and the arenas' free memory held 0.5 GB per xdist worker
## the files that hold serial tests: that tier collects only these (no TensorFlow imported)
SERIAL_FILES = $(shell grep -l 'mark\.serial' -r tests benchmarks/tests --include='test_*.py')
test: export MALLOC_ARENA_MAX := 2
test: setup ruff
	$(VENV)/python -m pytest -n 2 --dist loadfile -m "not serial"; shared=$$?; \
	mkdir -p build; $(MAKE) --no-print-directory typecheck > build/typecheck.log 2>&1 & typing=$$!; \
	$(VENV)/python -m pytest -m serial -n 2 --dist loadgroup $(SERIAL_FILES); serial=$$?; \
	wait $$typing; typed=$$?; cat build/typecheck.log; \
	[ $$shared -eq 0 ] && [ $$typed -eq 0 ] && { [ $$serial -eq 0 ] || [ $$serial -eq 5 ]; }

## the in-process tier: no daemon processes, no namespaces (under a minute)
test-fast: setup
	$(VENV)/python -m pytest -m "not slow and not deploy and not netns"

## the documentation site (mkdocs.yml, docs/), built with strict checks into site/: a broken link
## or anchor, or an API reference that names nothing, fails; docs-serve serves it on :8000
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/mkdocs serve

## ruff and mypy
lint: ruff typecheck

ruff: setup
	$(VENV)/ruff check wire daemon clients tests benchmarks examples scripts docs/hooks setup.py

typecheck: setup
	@bash scripts/typing_links.sh
	$(VENV)/mypy build/typing/decent_wire build/typing/decentd build/typing/decent benchmarks examples tests scripts/fuzz.py \
		scripts/gen_surface.py scripts/config_reference.py docs/hooks/site.py

## 200,000 malformed or adversarial messages at every door of 2 daemons (this process as rank 2)
## while exact ops run; counts per target and the verdict (~2.5 min; --seed S replays a run)
fuzz: setup
	$(VENV)/python scripts/fuzz.py --count 200000

## proof that the unit tests can fail: each mutation in scripts/mutation_check.py must be caught
mutation: setup
	$(VENV)/python scripts/mutation_check.py

## the import graph of wire/, daemon/ and clients/ (and its check: no cycles, layers call down)
imports:
	python3 scripts/import_graph.py

## churn and load: first 8 local workers on 2 daemons doing 4 KiB neighbor_allreduce ops as fast
## as they can for 5 min, then 64 MiB ones for 1 min (ops/s, p50/p99, daemon RSS, descriptors,
## CPU at start and end); then D-SGD on 8 namespaces 3 min without faults and 10 min with a
## seeded random fault every 15-30 s (daemon or worker SIGKILL, SIGSTOP 5 s, link down 5 s, an
## outsider on the bulk port 20 s), restarted by a supervisor loop (benchmarks/results/soak.*;
## ~21 min, root for the namespaces)
soak: setup
	$(VENV)/decentrun -np 8 --nodes 2 -- $(VENV)/python benchmarks/soak_load.py
	$(VENV)/python benchmarks/soak.py

## across sites: 8 namespaces whose every link is emulated with a true RTT (benchmarks/wan: a delay
## line over tun, built here), (a) 1 Gbit/s with 50 ms and (b) 100 Mbit/s with 100 ms; gloo's
## gradient allreduce (the baseline) against D-SGD, CHOCO int8, DiLoCo, decentralized DiLoCo and
## streaming decentralized DiLoCo with int8, all training the character-level transformer LM of
## examples/train_charlm.py: time to the baseline's loss, bytes, utilisation
## (benchmarks/results/wan.*; ~35 min, root for the namespaces)
wan: setup
	$(VENV)/python benchmarks/wan_train.py

## the same with the digits MLP as the workload (benchmarks/results/wan_digits.*; ~20 min, root)
wan-digits: setup
	$(VENV)/python benchmarks/wan_train.py --workload digits

## the learning rate every method of `make wan` shares, chosen for the baseline: gloo's gradient
## allreduce as arithmetic in one process, at 5 rates, loss after 200 steps
## (benchmarks/results/wan_lr.*; ~4 min, no root, no network)
wan-lr: setup
	$(VENV)/python benchmarks/wan_lr.py

## the emulated WAN checked: ping RTT and one TCP flow's throughput against the window/RTT math at
## RTT 10, 50 and 100 ms and 100 Mbit/s and 1 Gbit/s (benchmarks/results/wan_link.*; root)
wan-link: setup
	$(VENV)/python benchmarks/wan_link.py

## one 64 MiB transfer across 1 Gbit/s with a 100 ms RTT: one TCP flow against a striped link
## (transport.stripes), with the kernel's default socket buffers and raised ones
## (benchmarks/results/wan_stripes.*; ~2 min, root)
wan-stripes: setup
	$(VENV)/python benchmarks/wan_stripes.py

## the data-plane benchmarks, side by side with gloo (and hivemind, raw TCP) in the same run:
## 2 daemons on loopback, then 8 nodes in network namespaces at 1 Gbit/s (root only), then the
## report (benchmarks/results/REPORT.md and PNGs). The headline netns run is measured up to 3
## times while the hypervisor takes more than 10% of the CPU (every attempt is reported). Then
## 4 namespaces x 2 workers: gloo vs flat vs hierarchical D-SGD (netns_hier.py exits 3 when a
## target is missed: the report is written anyway; a crash, exit 1, stops here). Then what
## security costs: a 64 MiB neighbor_allreduce_ between 2 daemons in every mode, interleaved
## (security_cost.py: exit 3 when authentication without bulk encryption costs more than 5%).
bench:
	@bash scripts/setup.sh bench
	$(VENV)/decentrun -np 2 --nodes 2 -- $(VENV)/python benchmarks/p2p_vs_gloo.py
	$(VENV)/python benchmarks/netns_dsgd.py --attempts 3 --png benchmarks/results/netns_dsgd.png
	$(VENV)/python benchmarks/netns_dsgd.py --mode inplace --json benchmarks/results/netns_dsgd_inplace.json
	$(VENV)/python benchmarks/netns_dsgd.py --mode optimizer --json benchmarks/results/netns_dsgd_optimizer.json
	$(VENV)/python benchmarks/netns_hier.py --json benchmarks/results/netns_hier.json --png benchmarks/results/netns_hier.png || [ $$? -eq 3 ]
	$(VENV)/decentrun -np 2 --nodes 2 -- $(VENV)/python benchmarks/optimizer_step.py
	$(VENV)/decentrun -np 2 --nodes 2 -- $(VENV)/python benchmarks/tf_vs_torch.py
	$(VENV)/python benchmarks/security_cost.py --json benchmarks/results/security_cost.json --png benchmarks/results/security_cost.png || [ $$? -eq 3 ]
	$(VENV)/decentrun -np 2 --nodes 2 --set memory.arena_bytes=268435456 -- $(VENV)/python benchmarks/ddp_vs_gloo.py --steps 20 --json benchmarks/results/ddp_loopback.json --png benchmarks/results/ddp_loopback.png
	$(VENV)/python benchmarks/ddp_vs_gloo.py --netns 8 --rate 1gbit --json benchmarks/results/ddp_netns.json --png benchmarks/results/ddp_netns.png || [ $$? -eq 3 ]
	$(VENV)/python benchmarks/report.py

## every decentralized algorithm on real data (digits, breast_cancer), 8 workers, iid and
## non-iid: accuracy, loss curves, wall time, bytes (benchmarks/results/convergence.*; ~10 min)
convergence: setup
	$(VENV)/python benchmarks/convergence.py

## one slow worker among 8 (2x, 10x, 100x) and transient slowness: allreduce, synchronous
## D-SGD, AD-PSGD, WAGMA; throughput, time per epoch, accuracy (benchmarks/results/stragglers.*)
stragglers: setup
	$(VENV)/python benchmarks/stragglers.py

## 8 nodes in network namespaces (root) train D-SGD while one is killed and restarted and a link
## flaps, and gloo under the same kill: detection, lost steps, step time, rejoin, accuracy
## (benchmarks/results/chaos.json, .md and .png; ~4 min)
chaos: setup
	$(VENV)/python benchmarks/chaos.py

clean:
	rm -rf .venv build *.egg-info wire/v1/*_pb2*.py wire/v1/*_pb2*.pyi
