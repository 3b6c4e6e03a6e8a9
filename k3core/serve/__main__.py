"""`python -m k3core.serve [--model PATH|PRESET] [--port 30000] [--config FILE.yaml] ...`: the OpenAI-compatible
server. `--help` lists every flag; docs/serving.md has a quickstart."""
from __future__ import annotations

import logging
import sys

from k3core.config import list_presets
from k3core.serve.args import DEFAULT_MODEL, parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("k3core.serve")
    problem = _model_problem(args.model)
    if problem is not None:               # refused before binding the port: one sentence, no traceback
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.model in list_presets():
        default = " (the default)" if args.model == DEFAULT_MODEL else ""
        log.warning("serving the preset %s%s with RANDOM weights: the API works, the text is noise. "
                    "Pass --model CHECKPOINT_DIR for a real model.", args.model, default)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        log.warning("binding to %s without --api-key: anyone who can reach this address can use the server",
                    args.host)
    if args.node_rank == 0:
        log.info("device %s, dtype %s, backend %s; listening on http://%s:%d (health: /health turns 200 after "
                 "the warm-up request)", args.resolved_device(), args.resolved_dtype(), args.backend, args.host,
                 args.port)
    else:
        log.info("node %d of %d: running follower ranks only; node 0 serves HTTP", args.node_rank, args.nnodes)
    from k3core.serve.launch import build_server
    server = build_server(args)
    server.run()
    return server.exit_code          # 0, or EXIT_START_FAILED / EXIT_ENGINE_DIED (k3core.serve.launch)


def _model_problem(model: str) -> str | None:
    """Why --model cannot be served (its config, weight headers or tokenizer), checked without reading weights."""
    from k3core.config import ConfigError, load_config, resolve_model
    from k3core.model.loader import CheckpointError, check_checkpoint
    from k3core.tokenizer import TokenizerError, load_tokenizer
    if model in list_presets() or model.endswith((".yaml", ".yml")):
        return None
    try:
        path = resolve_model(model)
        config = load_config(path)
        check_checkpoint(path, config)
        load_tokenizer(path, config)
    except (ConfigError, CheckpointError, TokenizerError) as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
