"""The SGLang backend: RemotePipe, the fleet of servers it sends images to, the SGLang protocol, and the server
check behind `check-remote` and the node's "Test connection"."""
