"""The round protocol: a round's state and its pure transitions, a node's view of it, and the
waits of a node that joins, confirms or stands by; ElasticRendezvous, the one algorithm every
store-backed backend runs."""
