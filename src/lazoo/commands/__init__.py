"""The commands of the `lazoo` command line, one module each: `cmd_<name>(args)` runs `lazoo <name>` on the
arguments `lazoo_cli` has parsed, and `lazoo.cli.run` calls it. Each imports the model stack only when it runs."""
