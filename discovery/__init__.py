"""Discovery: signed announcements (policy versions, validators, relays) over libp2p gossipsub.

Importing this package loads nothing heavy: py-libp2p and trio are imported only by
`discovery.host` and `discovery.service`, so a role that reads announcements over HTTP
(`discovery.http`) or only shares the message types (`discovery.messages`) never loads them.
"""
