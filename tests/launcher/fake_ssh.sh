#!/bin/bash
# Stands in for ssh in the launcher tests (COLOSSAL_SSH): logs how it was called, then runs the
# remote command on this machine in an empty environment, as a fresh login on another host
# would, so only what the launcher forwards reaches the ranks.
port=default
if [ "$1" = "-p" ]; then
  port=$2
  shift 2
fi
host=$1
shift
if [ -n "$FAKE_SSH_LOG" ]; then echo "$host $port" >> "$FAKE_SSH_LOG"; fi
exec env -i /bin/bash -c "$*"
