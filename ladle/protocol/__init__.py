"""OpenAI API request and response models (pydantic), grouped by endpoint: common.py (errors,
usage, models, tokenize), sampling.py (shared sampling fields and to_sampling_params),
completion.py, chat.py. No I/O here."""
