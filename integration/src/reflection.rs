//! A generic gRPC client of an agent, the way `grpcurl` is one: it knows no
//! ferry `.proto` file and learns the services and their messages through
//! server reflection (`grpc.reflection.v1`), and asks `grpc.health.v1`.

use prost::Message;
use prost_types::FileDescriptorProto;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

#[derive(Debug, thiserror::Error)]
pub enum ReflectionError {
    #[error("{call}: {source}")]
    Rpc {
        call: &'static str,
        source: Box<tonic::Status>,
    },
    #[error("{call}: the server closed the stream without an answer")]
    NoAnswer { call: &'static str },
    #[error("{call}: error {code} from the reflection service: {message}")]
    Refused {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error("{call}: unexpected answer {answer}")]
    Unexpected { call: &'static str, answer: String },
    #[error("decoding a file descriptor: {0}")]
    Decode(#[from] prost::DecodeError),
}

fn decode_files(encoded: &[Vec<u8>]) -> Result<Vec<FileDescriptorProto>, ReflectionError> {
    encoded
        .iter()
        .map(|bytes| Ok(FileDescriptorProto::decode(bytes.as_slice())?))
        .collect()
}

/// One request on the reflection stream, one answer.
async fn ask(
    channel: Channel,
    call: &'static str,
    request: MessageRequest,
) -> Result<MessageResponse, ReflectionError> {
    let rpc = |source| ReflectionError::Rpc {
        call,
        source: Box::new(source),
    };
    let mut client = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .map_err(rpc)?
        .into_inner();
    let ServerReflectionResponse {
        message_response, ..
    } = answers
        .message()
        .await
        .map_err(rpc)?
        .ok_or(ReflectionError::NoAnswer { call })?;
    match message_response {
        Some(MessageResponse::ErrorResponse(e)) => Err(ReflectionError::Refused {
            call,
            code: e.error_code,
            message: e.error_message,
        }),
        Some(answer) => Ok(answer),
        None => Err(ReflectionError::NoAnswer { call }),
    }
}

/// The services the server advertises (`grpcurl list`).
pub async fn list_services(channel: Channel) -> Result<Vec<String>, ReflectionError> {
    const CALL: &str = "ListServices";
    match ask(channel, CALL, MessageRequest::ListServices(String::new())).await? {
        MessageResponse::ListServicesResponse(r) => {
            Ok(r.service.into_iter().map(|s| s.name).collect())
        }
        other => Err(ReflectionError::Unexpected {
            call: CALL,
            answer: format!("{other:?}"),
        }),
    }
}

/// The file that defines `symbol` and the files it imports (`grpcurl
/// describe SYMBOL`).
pub async fn file_containing_symbol(
    channel: Channel,
    symbol: &str,
) -> Result<Vec<FileDescriptorProto>, ReflectionError> {
    const CALL: &str = "FileContainingSymbol";
    match ask(
        channel,
        CALL,
        MessageRequest::FileContainingSymbol(symbol.to_owned()),
    )
    .await?
    {
        MessageResponse::FileDescriptorResponse(r) => decode_files(&r.file_descriptor_proto),
        other => Err(ReflectionError::Unexpected {
            call: CALL,
            answer: format!("{other:?}"),
        }),
    }
}

/// The file named `name` (`grpcurl` fetches each import of a file this way).
pub async fn file_by_filename(
    channel: Channel,
    name: &str,
) -> Result<Vec<FileDescriptorProto>, ReflectionError> {
    const CALL: &str = "FileByFilename";
    match ask(
        channel,
        CALL,
        MessageRequest::FileByFilename(name.to_owned()),
    )
    .await?
    {
        MessageResponse::FileDescriptorResponse(r) => decode_files(&r.file_descriptor_proto),
        other => Err(ReflectionError::Unexpected {
            call: CALL,
            answer: format!("{other:?}"),
        }),
    }
}

/// `grpc.health.v1.Health/Check` for `service` ("" is the whole server).
pub async fn health_check(
    channel: Channel,
    service: &str,
) -> Result<ServingStatus, ReflectionError> {
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .map_err(|source| ReflectionError::Rpc {
            call: "Health/Check",
            source: Box::new(source),
        })?
        .into_inner();
    ServingStatus::try_from(answer.status).map_err(|_| ReflectionError::Unexpected {
        call: "Health/Check",
        answer: format!("status {}", answer.status),
    })
}
