"""The API's language: OpenAI's request and response models (``openai.py``), the errors the API returns
(``errors.py``), the chat messages normalised for the services (``messages.py``) and the request's
sampling parameters (``sampling.py``). It imports no other room of the router."""
