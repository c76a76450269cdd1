#!/bin/sh
# molecule test -s proxmox with a made-up API token secret for this run only (never written to a file).
set -eu
cd "$(dirname "$0")/../.."
PROXMOX_USER=root@pam PROXMOX_TOKEN_ID=dflash
PROXMOX_TOKEN_SECRET="made-up-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export PROXMOX_USER PROXMOX_TOKEN_ID PROXMOX_TOKEN_SECRET
exec molecule test -s proxmox
