"""``python -m kvferry.integrations.dynamo ARGS``: ``python -m dynamo.vllm ARGS`` with kvferry registered."""

from kvferry.integrations.dynamo import main

main()
