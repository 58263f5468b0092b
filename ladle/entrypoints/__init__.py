"""The OpenAI-compatible server: CLI (cli.py), app and process wiring (api_server.py), the
endpoint handlers (serving_completion.py, serving_chat.py) and their shared helpers."""
