"""Talking to servers over HTTP: URLs, API keys bound to origins, the JSON client, cancellation, the event-loop thread."""
