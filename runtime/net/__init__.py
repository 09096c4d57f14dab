"""Talking to servers over HTTP: URLs, API keys bound to origins, settings, the JSON client, error answers,
cancellation, the event-loop thread."""
