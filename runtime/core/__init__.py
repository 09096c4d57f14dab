"""What every part shares: errors, the host interface, the request and result, the pipe protocol, the model variant."""
