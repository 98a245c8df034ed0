"""The MQTT request bridge: requests from a broker topic to the mesh's OpenAI-compatible HTTP
entry, each answered once on the reply topic it names (docs/bridge.md).

- ``protocol``: the request and reply messages (pure parsing and building);
- ``store``: the durable per-request state that makes answers exactly-once per id;
- ``mesh``: one HTTP submission with bounded retries;
- ``mqtt``: the bridge process (paho client, back pressure, recovery);
- ``cli``: ``adaptermesh mqtt-bridge``.
"""
