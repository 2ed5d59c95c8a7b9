#!/bin/sh
echo "coverage is not supported in the offline build" >&2
exit 1
