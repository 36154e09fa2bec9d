"""Every reply the inbound SMTP server sends, by name.

ENHANCEDSTATUSCODES is advertised, so every reply after the greeting (except
the lines of the EHLO/HELO reply and ``354``) carries an RFC 3463 code.
Replies aiosmtpd builds itself get one from ``enhance()``.
"""

from __future__ import annotations

import re

# --- success
OK = "250 2.0.0 Ok"
SENDER_OK = "250 2.1.0 Ok"
RECIPIENT_OK = "250 2.1.5 Ok"
QUEUED = "250 2.0.0 Ok: queued as {qid}"
START_DATA = "354 End data with <CR><LF>.<CR><LF>"
CANNOT_VRFY = "252 2.0.0 Cannot VRFY user, but will accept message and attempt delivery"

# --- command syntax and sequence
MAIL_SYNTAX = "501 5.5.4 Syntax: MAIL FROM:<address> [parameters]"
RCPT_SYNTAX = "501 5.5.4 Syntax: RCPT TO:<address> [parameters]"
HELO_SYNTAX = "501 Syntax: HELO hostname"  # a reply to HELO: no enhanced code
EHLO_SYNTAX = "501 Syntax: EHLO hostname"  # a reply to EHLO: no enhanced code
VRFY_SYNTAX = "501 5.5.4 Syntax: VRFY <address>"
NESTED_MAIL = "503 5.5.1 Error: nested MAIL command"
NEED_MAIL = "503 5.5.1 Error: need MAIL command"
NO_VALID_RECIPIENTS = "554 5.5.1 Error: no valid recipients"
DATA_SYNTAX = "501 5.5.4 Syntax: DATA"
BAD_SENDER_SYNTAX = "553 5.1.7 Bad sender address syntax"
BAD_RECIPIENT_SYNTAX = "553 5.1.3 Bad recipient address syntax"
SENDER_NOT_FQDN = "553 5.1.7 Sender address must be fully qualified (user@domain)"
RECIPIENT_NOT_FQDN = "553 5.1.3 Recipient address must be fully qualified (user@domain)"
SENDER_NEEDS_SMTPUTF8 = "553 5.6.7 Non-ASCII sender address requires SMTPUTF8"
RECIPIENT_NEEDS_SMTPUTF8 = "553 5.6.7 Non-ASCII recipient address requires SMTPUTF8"
UNKNOWN_PARAMETER = "555 5.5.4 Unsupported parameter {name}"
DUPLICATE_PARAMETER = "501 5.5.4 Duplicate parameter {name}"
BAD_PARAMETER = "501 5.5.4 Invalid value for {name}"
PARAMETER_SYNTAX = "501 5.5.4 Bad parameter syntax"
NO_PARAMETERS_WITH_HELO = "501 5.5.4 Parameters need EHLO"

# --- relay control (RFC 5321 3.6, 7.1; nmap smtp-open-relay)
RELAY_DENIED = "554 5.7.1 Relay access denied"
ROUTING_DENIED = "554 5.7.1 Sender-specified routing (%, !, @ or source route) is not relayed"

# --- limits
MESSAGE_TOO_BIG = "552 5.3.4 Message size exceeds fixed maximum message size"
TOO_MANY_RECIPIENTS = "452 4.5.3 Too many recipients"
TOO_MANY_HOPS = "554 5.4.6 Too many hops (Received headers): routing loop"
# Postfix's header_size_limit, and a count of fields (MAILRELAY_SMTP_MAX_HEADER_*)
TOO_MANY_HEADER_FIELDS = "552 5.3.4 Message header has too many header fields (more than {limit})"
HEADER_FIELD_TOO_LONG = "552 5.3.4 Message header field too long (more than {limit} bytes)"

# --- message data (SMTP smuggling, CVE-2023-51764 family)
BARE_LINE_ENDING = "550 5.6.0 Message contains bare CR or LF; lines must end with CRLF"

# --- our side
STORE_FAILED = "451 4.3.0 Error: message not stored; try again later"
INTERNAL_ERROR = "451 4.3.0 Error: internal server error; try again later"
SHUTTING_DOWN = "421 4.3.2 Service shutting down, closing transmission channel"
TIMEOUT = "421 4.4.2 Timeout exceeded, closing transmission channel"

# --- connection and session limits (issue #9; Postfix's anvil and smtpd limits)
TOO_MANY_CONNECTIONS = "421 4.7.0 Too many connections, try again later"
TOO_MANY_FROM_CLIENT = "421 4.7.0 Too many connections from your address, try again later"
SESSION_TOO_LONG = "421 4.4.2 Session time limit exceeded, closing transmission channel"
TOO_MANY_JUNK_COMMANDS = "421 4.7.0 Too many commands without a message, closing channel"
DATA_TOO_SLOW = "421 4.4.2 Data timeout or rate too low, closing transmission channel"
EXPN_DISABLED = "502 5.5.1 EXPN not available"

# --- submission and AUTH (RFC 4954, RFC 3207, RFC 6409, RFC 8314)
STARTTLS_FIRST = "530 5.7.0 Must issue a STARTTLS command first"
AUTH_REQUIRED = "530 5.7.0 Authentication required"
AUTH_OK = "235 2.7.0 Authentication successful"
AUTH_FAILED = "535 5.7.8 Authentication credentials invalid"
AUTH_NEEDS_TLS = "538 5.7.11 Encryption required for requested authentication mechanism"
AUTH_LOCKED_OUT = "421 4.7.0 Too many authentication failures from your address, try again later"
AUTH_ACCOUNT_LOCKED = "454 4.7.0 Too many authentication failures for this account, try later"
AUTH_UNAVAILABLE = "454 4.7.0 Temporary authentication failure, try again later"
AUTH_LINE_TOO_LONG = "500 5.5.6 Authentication Exchange line is too long"  # RFC 4954 4
AUTH_SYNTAX = "501 5.5.4 Syntax: AUTH mechanism [initial-response]"
AUTH_MECHANISM = "504 5.5.4 Unrecognized authentication type (PLAIN and LOGIN are offered)"
AUTH_ALREADY = "503 5.5.1 Error: already authenticated"
AUTH_NEEDS_EHLO = "503 5.5.1 Error: send EHLO first"
AUTH_IN_TRANSACTION = "503 5.5.1 Error: AUTH not permitted during a mail transaction"
AUTH_ABORTED = "501 5.7.0 Authentication aborted"
AUTH_BAD_BASE64 = "501 5.5.2 Cannot decode base64"
AUTH_BAD_PLAIN = "501 5.5.2 Cannot split the PLAIN response (authzid NUL authcid NUL passwd)"
SENDER_NOT_ALLOWED = "553 5.7.1 <{address}>: Sender address not allowed for account {username}"
# reject_sender_login_mismatch, applied to the header: DKIM would vouch for it
HEADER_SENDER_NOT_ALLOWED = (
    "550 5.7.1 <{address}>: {field} header address not allowed for account {username}"
)
ACCOUNT_RATE_LIMITED = (
    "451 4.7.1 Account {username} has sent its {limit} messages this hour, try again later"
)

# aiosmtpd's own replies whose class default is not the best code
_BUILTIN = {
    "502 EXPN not implemented": EXPN_DISABLED,
}

# By reply code, the closest RFC 3463 code; the class default otherwise.
_BY_CODE = {
    "214": "2.0.0",
    "220": "2.0.0",  # STARTTLS "Ready to start TLS" (the greeting is never enhanced)
    "221": "2.0.0",
    "235": "2.7.0",
    "250": "2.0.0",
    "252": "2.0.0",
    "421": "4.3.2",
    "450": "4.2.0",
    "451": "4.3.0",
    "452": "4.3.1",
    "454": "4.7.0",
    "500": "5.5.2",
    "501": "5.5.4",
    "502": "5.5.1",
    "503": "5.5.1",
    "504": "5.5.4",
    "530": "5.7.0",
    "535": "5.7.8",
    "538": "5.7.11",
    "550": "5.0.0",
    "552": "5.3.4",
    "553": "5.1.3",
    "554": "5.0.0",
    "555": "5.5.4",
}
_CLASS_DEFAULT = {"2": "2.0.0", "3": "", "4": "4.0.0", "5": "5.0.0"}
_HAS_ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3}(?: |$)")


def enhance(reply: str) -> str:
    """Give a reply an enhanced status code if it lacks one (1xx/3xx are left alone)."""
    known = _BUILTIN.get(reply)
    if known is not None:
        return known
    if _HAS_ENHANCED.match(reply) or len(reply) < 3 or not reply[:3].isdigit():
        return reply
    code = reply[:3]
    enhanced = _BY_CODE.get(code) or _CLASS_DEFAULT.get(code[0], "")
    if not enhanced:
        return reply
    sep = reply[3:4] or " "
    text = reply[4:]
    return f"{code}{sep}{enhanced} {text}" if text else f"{code}{sep}{enhanced}"
