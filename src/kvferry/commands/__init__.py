"""CLI subcommands, one module each; ``kvferry.cli.COMMANDS`` lists their ``add_*_parser`` functions."""
