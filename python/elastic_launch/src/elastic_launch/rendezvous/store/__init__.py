"""The store interface the round protocol runs on (api), a node's session with it, the endpoints
of its members, and how a client tells which store answers."""
