"""Subcommands of `moe-lightning`; each module has add_parser(sub, name) and run(args)."""
