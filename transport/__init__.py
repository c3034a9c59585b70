"""The wire: typed msgpack messages (messages), the ZeroMQ bus (bus), CurveZMQ keys (auth), message logs
(msglog), bulk tensor links (bulk) and the RL message kinds (protocol). Nothing here knows what an actor does."""
