# The project's entry points; each is one script (they need root: runc sandboxes).
.PHONY: all build test bench bench-quick demo eval

BUILD ?= build
PARALLEL ?= 4

all: build

build:
	bash scripts/build.sh $(CURDIR)/$(BUILD)

test:            ## setup, build, unit + integration tests (incl. cellblock eval on notebooks/), ASan, format, fuzz
	bash scripts/test.sh

bench:           ## the benchmark suite (bench/results/)
	bash scripts/bench.sh

bench-quick:
	bash scripts/bench.sh --quick

demo:            ## the main job: a real session driven by the Python client, then cellblock eval
	bash scripts/demo.sh

eval: build      ## every notebook of notebooks/ in fresh sessions (a running server, or an embedded one)
	$(BUILD)/bin/cellblock eval notebooks --parallel $(PARALLEL) --report $(BUILD)/eval
	@echo "report: $(BUILD)/eval/report.html"
