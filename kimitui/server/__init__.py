"""The HTTP API (llama-server and OpenAI compatible) and the client for remote mode.

app.py builds the Starlette app over an Engine, runner.py puts it on a socket (headless or in
a thread beside the TUI), cli.py is ``kimitui serve``, client.py is ``RemoteEngine``.
Nothing is imported here so the TUI can use the client without loading the server stack.
"""
