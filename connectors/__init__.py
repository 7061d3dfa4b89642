"""Engine-facing connector API over ``kvstore`` (issue 3: in-process connector; issue 4: sidecar
client connector). Nothing is implemented here yet; engines use ``kvstore.TieredStore`` directly."""
