"""`sitsctl`, the command-line client of a running sitsd daemon (`sitsd.ctl.main:main`).

`main` parses the global options and dispatches to one module per command group (`generate`,
`status`, `models`, `health`); `client` holds the channel, the admin token and error wording.
Adding a command is one module with a `register(commands)` function and one line in
`main.COMMANDS`.
"""
