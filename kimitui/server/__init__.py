"""The HTTP API (llama-server, OpenAI and Anthropic compatible) and the client for remote mode.

app.py builds the Starlette app over an engine, runner.py puts it on a socket (headless or in
a thread beside the TUI), client.py is ``RemoteEngine``; ``kimitui serve`` is kimitui/serve_cmd.py.
Nothing is imported here so the TUI can use the client without loading the server stack.
"""
